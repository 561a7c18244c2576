#!/bin/sh
# Runs inside the chroot after the overlay/ files were copied in.
set -eu

systemctl enable systemd-networkd.service
systemctl mask systemd-networkd-wait-online.service
systemctl enable serial-getty@ttyS0.service
systemctl enable wakeful-seed.service bootmarker.service
systemctl enable wakeful-xvfb.service wakeful-wm.service wakeful-x11vnc.service wakeful-x11vnc-view.service \
    wakeful-chromium.service
# No periodic maintenance: the VM is suspended when idle, has no route to a mirror, and every wakeup costs a host
# core under TCG (e2scrub_reap alone held the boot back by minutes).
systemctl mask e2scrub_reap.service e2scrub_all.timer apt-daily.timer apt-daily-upgrade.timer \
    dpkg-db-backup.timer fstrim.timer

# No baked-in identity: host keys come from the seed disk at every boot, the machine ID is made at first boot.
rm -f /etc/ssh/ssh_host_*
: > /etc/machine-id
rm -f /var/lib/dbus/machine-id

# No password for anyone: root logs in over SSH with a key only ('*' matches no password).
usermod -p '*' root

# The guest reaches nothing but the egress proxy, so it needs no resolver and no package lists;
# point apt at the public archive rather than at the mirror the image was built from.
rm -f /etc/resolv.conf /etc/apt/sources.list
cat > /etc/apt/sources.list.d/debian.sources <<'SOURCES'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://security.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/log/apt/* /var/log/dpkg.log
rm -rf /tmp/* /var/tmp/*
