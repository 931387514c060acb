# hostdevd %preun ($1: 0 on erase, 1 and more on upgrade).
if [ "$1" -eq 0 ] && [ -d /run/systemd/system ]; then
    systemctl --no-reload disable --now hostdevd.service >/dev/null 2>&1 || :
fi
