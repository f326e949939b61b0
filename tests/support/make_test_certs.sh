#!/usr/bin/env bash
# Makes throwaway certificates for the TLS tests in DIR (nothing secret is checked in):
#   ca.pem / ca.key              the CA that signs the rest
#   server.pem / server.key      for "localhost" and 127.0.0.1, signed by ca
#   client.pem / client.key      a client certificate signed by ca (mutual TLS)
#   client-b.pem / client-b.key  another client's, another subject (another tenant)
#   other-ca.pem                 an unrelated CA (a client that trusts the wrong CA)
#
#   tests/support/make_test_certs.sh /tmp/certs
set -euo pipefail
dir=${1:?usage: make_test_certs.sh DIR}
mkdir -p "$dir"
cd "$dir"
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out "$1" 2>/dev/null; }
ca() {
  key "$1.key"
  openssl req -x509 -new -key "$1.key" -days 2 -subj "/CN=$2" -out "$1.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign"
}
leaf() {  # name, CN, extensions
  key "$1.key"
  openssl req -new -key "$1.key" -subj "/CN=$2" -out "$1.csr"
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
ca ca "packd test CA"
ca other-ca "another CA"
leaf server localhost "subjectAltName=DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth"
leaf client "packd test client" "extendedKeyUsage=clientAuth"
leaf client-b "packd test client b" "extendedKeyUsage=clientAuth"
