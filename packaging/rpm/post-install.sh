# hostdevd %post ($1: 1 on first install, 2 and more on upgrade).
if [ "$1" -eq 1 ]; then
    # Enabled on first install, as on Debian, booted or not: `systemctl enable` works
    # offline too (an image built in a chroot, a kickstart %post), and without it such a
    # host would boot without the agent. A preset policy that disables it is overridden.
    systemctl enable hostdevd.service >/dev/null 2>&1 || :
fi
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
    if [ "$1" -eq 1 ]; then
        systemctl start hostdevd.service >/dev/null 2>&1 || :
    fi
fi
if command -v udevadm >/dev/null 2>&1 && [ -d /run/udev ]; then
    udevadm control --reload || :
fi
