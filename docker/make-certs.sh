#!/bin/sh
# A private CA and the certificates docker/compose.tls.yaml mounts, written to DIR (default:
# docker/certs). For trying mutual TLS end to end; in production use your own PKI.
#   sh docker/make-certs.sh [DIR]
# Server certificates carry their compose service name, localhost and 127.0.0.1 (the
# containers' health checks dial 127.0.0.1); client.crt is the client certificate the node
# presents to the store and lora-client presents to the node.
set -eu
out=${1:-$(dirname "$0")/certs}
mkdir -p "$out"
cd "$out"
days=365
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1.key" 2>/dev/null; }

key ca
openssl req -x509 -new -key ca.key -out ca.crt -days "$days" -subj "/CN=lora-serving local CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"

sign() {  # name, extensions
  key "$1"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$1"
  printf '%s\n' "$2" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" \
    -out "$1.crt" -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
for service in adapter-store inference-node; do
  sign "$service" "subjectAltName=DNS:$service,DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth,clientAuth"
done
sign client "extendedKeyUsage=clientAuth"
rm -f ca.srl
chmod 644 ./*.crt ./*.key  # read by the containers' non-root users; throwaway keys
echo "certificates in $out: ca.crt, adapter-store.{crt,key}, inference-node.{crt,key}, client.{crt,key}"
