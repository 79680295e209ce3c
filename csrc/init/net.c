/* The sandbox's network: its own namespace with only lo, brought up. */
#include <net/if.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "init.h"

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
}
