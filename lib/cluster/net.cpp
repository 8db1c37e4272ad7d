// ResolveHost, LocalAddressToward, InterfaceAddress.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "cluster/cluster.h"

namespace ms::cluster {

bool IsLoopback(const std::string& address) {
  in_addr a{};
  return inet_pton(AF_INET, address.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

Result<std::string> ResolveHost(const std::string& name) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(name.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return NotFound(
        "host '{}' does not resolve to an IPv4 address ({}); check /etc/hosts or DNS, or set "
        "runtime.address / runtime.interface",
        name, gai_strerror(rc));
  }
  char buf[INET_ADDRSTRLEN] = {0};
  const auto* sin = reinterpret_cast<const sockaddr_in*>(res->ai_addr);
  inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof buf);
  freeaddrinfo(res);
  return std::string(buf);
}

Result<std::string> LocalAddressToward(const std::string& peer) {
  MS_ASSIGN_OR_RETURN(std::string address, ResolveHost(peer));
  if (IsLoopback(address)) return std::string("127.0.0.1");
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoError("socket", errno);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(9);  // any port: a UDP connect only picks the route, nothing is sent
  inet_pton(AF_INET, address.c_str(), &to.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
    Status s = ErrnoError(
        fmt::format("no route from this host to {} ({}); set runtime.address or runtime.interface", peer, address),
        errno);
    close(fd);
    return s;
  }
  sockaddr_in me{};
  socklen_t len = sizeof me;
  const int rc = getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len);
  const int err = errno;
  close(fd);
  if (rc != 0) return ErrnoError("getsockname", err);
  char buf[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &me.sin_addr, buf, sizeof buf);
  return std::string(buf);
}

Result<std::string> AddressTowardNodes(const std::vector<std::string>& nodes) {
  const std::string me = HostName();
  Status last = Status::Ok();
  for (const auto& node : nodes) {
    if (node == me) continue;
    auto a = LocalAddressToward(node);
    if (a.ok()) return a;
    last = a.status();
  }
  if (!last.ok()) return last;
  return std::string("127.0.0.1");  // every node is this host
}

Result<std::string> InterfaceAddress(const std::string& interface) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return ErrnoError("getifaddrs", errno);
  std::string found, names;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    char buf[INET_ADDRSTRLEN] = {0};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
    if (interface == i->ifa_name && found.empty()) found = buf;
    names += fmt::format("{}{} ({})", names.empty() ? "" : ", ", i->ifa_name, buf);
  }
  freeifaddrs(list);
  if (found.empty()) {
    return NotFound("network interface '{}' has no IPv4 address on host {}; interfaces here: {}", interface, HostName(),
                    names.empty() ? "none" : names);
  }
  return found;
}

}  // namespace ms::cluster
