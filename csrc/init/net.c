/* The sandbox's network: its own namespace with only lo, brought up, and the egress
 * listeners (karotte/net.py) made on it before any agent code runs. */
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_link.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <net/if.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "init.h"

static uint32_t listen_ports[MAX_LISTEN];
static int listen_fds[MAX_LISTEN];
static int n_listen;

/* KT_LOOPBACK's payload: the ports of the listeners, u32 each (none for network "none"). */
int set_listeners(const char *data, uint32_t len)
{
    if (len % 4 != 0 || len / 4 > MAX_LISTEN)
        return -1;
    n_listen = (int)(len / 4);
    memcpy(listen_ports, data, len);
    for (int i = 0; i < n_listen; i++)
        if (listen_ports[i] == 0 || listen_ports[i] > 65535)
            return -1;
    return 0;
}

/* A listening TCP socket on 127.0.0.1:port of this namespace. The host serves it: an
 * agent connecting here reaches the host-side proxy, and nothing else, since this
 * namespace has no route out. No SO_REUSEPORT: no agent socket can share the port. */
static int make_listener(uint32_t port)
{
    struct sockaddr_in addr = {0};
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0 || bind(s, (struct sockaddr *)&addr, sizeof(addr)) < 0 || listen(s, 128) < 0)
        setup_fail(KS_LOOPBACK, "listen on 127.0.0.1:%u", port);
    return s;
}

/* Linux 6.3's IPv4 BIG TCP attribute, past older headers' enum. */
#define KAROTTE_IFLA_GSO_IPV4_MAX_SIZE 63
/* GSO_MAX_SIZE of Linux 5.19 and later: what lo's TSO takes. */
#define LOOPBACK_GSO_MAX 524280u

/* Whether this kernel's release (the host's: a UTS namespace keeps it) is at least
 * major.minor. */
static int kernel_at_least(unsigned major, unsigned minor)
{
    struct utsname u;
    unsigned a = 0, b = 0;
    if (uname(&u) < 0 || sscanf(u.release, "%u.%u", &a, &b) != 2)
        return 0;
    return a > major || (a == major && b >= minor);
}

/* Let a TCP segment on this lo be as large as lo takes (BIG TCP): 512 KiB, not 64 KiB.
 * The proxy's connections to the agent run here, and the kernel's work per segment is
 * most of a loopback's cost: a bare copy relay went from 0.56-0.63 to 0.78-0.82 of a
 * direct download with it (docs/egress.md, Where the proxy runs). Only the listeners' sockets and the agent's
 * see this lo.
 *
 * It is kernel surface the agent reaches: BIG TCP segments on its own loopback, which it
 * could not make itself (no CAP_NET_ADMIN). So only from Linux 6.6, the first long-term
 * kernel after IPv4 BIG TCP (6.3), past the fix of CVE-2023-53669 (skb_copy_ubufs with a
 * MSG_ZEROCOPY send over a BIG TCP lo; fixed in 6.1.29, 6.2.16, 6.3.3); an older kernel
 * keeps its default. A kernel that refuses the size keeps it too. Sockets take the size
 * when they connect or are accepted, so this comes before the listeners. */
static void widen_loopback(void)
{
    struct {
        struct nlmsghdr nh;
        struct ifinfomsg ifi;
        struct {
            struct rtattr rta;
            uint32_t value;
        } attrs[2];
    } req = {0};
    char answer[512];
    uint16_t types[2] = {IFLA_GSO_MAX_SIZE, KAROTTE_IFLA_GSO_IPV4_MAX_SIZE};
    req.nh.nlmsg_len = sizeof(req);
    req.nh.nlmsg_type = RTM_NEWLINK;
    req.nh.nlmsg_flags = NLM_F_REQUEST | NLM_F_ACK;
    req.ifi.ifi_family = AF_UNSPEC;
    req.ifi.ifi_index = (int)if_nametoindex("lo");
    for (int i = 0; i < 2; i++) {
        req.attrs[i].rta.rta_len = RTA_LENGTH(sizeof(uint32_t));
        req.attrs[i].rta.rta_type = types[i];
        req.attrs[i].value = LOOPBACK_GSO_MAX;
    }
    int s = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
    if (s < 0)
        return;
    if (req.ifi.ifi_index > 0 && send(s, &req, sizeof(req), 0) == (ssize_t)sizeof(req))
        (void)recv(s, answer, sizeof(answer), 0); /* the ack: 0 or the kernel's refusal */
    close(s);
}

void bring_up_loopback(void)
{
    struct ifreq ifr = {0};
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        setup_fail(KS_LOOPBACK, "socket for loopback");
    snprintf(ifr.ifr_name, IFNAMSIZ, "lo");
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
        setup_fail(KS_LOOPBACK, "get lo flags");
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
        setup_fail(KS_LOOPBACK, "bring lo up");
    close(s);
    if (n_listen && kernel_at_least(6, 6))
        widen_loopback();
    for (int i = 0; i < n_listen; i++)
        listen_fds[i] = make_listener(listen_ports[i]);
}

/* The fds KP_READY carries after the workspace's (and the upper's): the listeners in
 * KT_LOOPBACK's order. */
int ready_fds(int *fds, int n)
{
    memcpy(fds + n, listen_fds, sizeof(int) * (size_t)n_listen);
    return n + n_listen;
}

/* Once they are the host's: init keeps no copy an agent's process could accept on. */
void close_listeners(void)
{
    for (int i = 0; i < n_listen; i++)
        close(listen_fds[i]);
    n_listen = 0;
}
