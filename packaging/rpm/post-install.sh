# hostdevd %post ($1: 1 on first install, 2 and more on upgrade).
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
    if [ "$1" -eq 1 ]; then
        # Enable (and start) as on Debian; a preset policy that disables it is overridden.
        systemctl enable --now hostdevd.service >/dev/null 2>&1 || :
    fi
fi
if command -v udevadm >/dev/null 2>&1 && [ -d /run/udev ]; then
    udevadm control --reload || :
fi
