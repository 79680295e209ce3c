"""The namespace flags of clone3, clone and unshare (linux/sched.h).

The spawn asks for them (karotte/native.py), and the seccomp policy refuses them to the
agent (karotte/seccomp.py, which exports them too).
"""

CLONE_NEWTIME = 0x00000080
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEW_ANY = (CLONE_NEWTIME | CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC
                 | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET)
