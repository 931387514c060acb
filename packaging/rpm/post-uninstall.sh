# hostdevd %postun ($1: 0 on erase, 1 and more on upgrade). RPM has no purge: the ledger
# in /var/lib/hostdevd and a changed /etc/hostdevd/config.toml (kept as .rpmsave) stay
# after an erase; delete them by hand once no claim matters.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
    if [ "$1" -ge 1 ]; then
        systemctl try-restart hostdevd.service >/dev/null 2>&1 || :
    fi
fi
if command -v udevadm >/dev/null 2>&1 && [ -d /run/udev ]; then
    udevadm control --reload || :
fi
