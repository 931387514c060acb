# hostdevd %preun ($1: 0 on erase, 1 and more on upgrade).
# Disabled booted or not, as %post enabled it: an image built offline that removes the
# package keeps no link to a unit file that is gone.
if [ "$1" -eq 0 ]; then
    if [ -d /run/systemd/system ]; then
        systemctl --no-reload disable --now hostdevd.service >/dev/null 2>&1 || :
    else
        systemctl --no-reload disable hostdevd.service >/dev/null 2>&1 || :
    fi
fi
