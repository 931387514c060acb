# hostdevd %pre: the group owning the socket (api.socket_group), before any file lands.
getent group hostdevd >/dev/null 2>&1 || groupadd -r hostdevd || :
