#!/usr/bin/env bash
# Makes the certificates the TLS tests use, with openssl, into DIR:
#   ca.pem ca.key                  the test CA
#   server.pem server.key          signed by it, for localhost and 127.0.0.1
#   client.pem client.key          a client certificate signed by it
#   other_ca.pem other_ca.key      an unrelated CA (the "wrong CA")
#   other_client.pem other_client.key  a client certificate the unrelated CA signed
# EC P-256 keys, valid for two days: made fresh by each test run.
# Usage: make_certs.sh DIR
set -euo pipefail
dir="${1:?usage: make_certs.sh DIR}"
mkdir -p "$dir"
cd "$dir"

make_ca() {  # name, CN
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$1.key" -out "$1.pem" -days 2 -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

make_leaf() {  # name, CN, CA name, extensions
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null
  printf '%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -CAcreateserial \
    -out "$1.pem" -days 2 -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

make_ca ca "te_server test CA"
make_ca other_ca "an unrelated CA"
make_leaf server localhost ca \
  "subjectAltName=DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth
basicConstraints=CA:FALSE"
make_leaf client te-test-client ca \
  "extendedKeyUsage=clientAuth
basicConstraints=CA:FALSE"
make_leaf other_client te-other-client other_ca \
  "extendedKeyUsage=clientAuth
basicConstraints=CA:FALSE"
chmod 600 ./*.key
