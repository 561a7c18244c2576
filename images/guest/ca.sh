#!/bin/sh
# Runs inside the chroot with the deployment CA at /usr/local/share/ca-certificates/wakeful.crt:
# trust it system-wide and in chromium's NSS database for TLS server authentication.
set -eu
update-ca-certificates --fresh >/dev/null
install -d -m 0700 /root/.pki /root/.pki/nssdb
certutil -d sql:/root/.pki/nssdb -N --empty-password
certutil -d sql:/root/.pki/nssdb -A -t "C,," -n wakeful-deployment-ca -i /usr/local/share/ca-certificates/wakeful.crt
certutil -d sql:/root/.pki/nssdb -L -n wakeful-deployment-ca >/dev/null
