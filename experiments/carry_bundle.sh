#!/usr/bin/env bash
# Packs what the device calls carry (.carry/triton39/part.* and .carry/peers*/*, docs/usage.md) into one tar cut
# into K parts of at most MAX_MB (default 52: a call carries 64 MiB, the working tree included), one folder
# each, .carry/bundle1/bundle-ofK.00 ...: K calls back to back, each carrying one folder and running
# `gpu_run.sh stash`, bring both; the last one's stash unpacks them into /tmp/tritonstash and /tmp/peerstash.
set -euo pipefail
cd "$(dirname "$0")/.."
max=$(( ${MAX_MB:-52} * 1000000 ))
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/tritonstash" "$tmp/peerstash"
ln -s "$(pwd)"/.carry/triton39/part.* "$tmp/tritonstash/"
ln -s "$(pwd)"/.carry/peers*/* "$tmp/peerstash/"
tar -chf "$tmp/all.tar" -C "$tmp" tritonstash peerstash
size=$(stat -c %s "$tmp/all.tar"); k=$(( (size + max - 1) / max ))
rm -rf .carry/bundle*
split -n "$k" -d -a 2 "$tmp/all.tar" "$tmp/bundle-of$k."
for i in $(seq 1 "$k"); do
  mkdir -p ".carry/bundle$i" && mv "$tmp/bundle-of$k.$(printf %02d $((i - 1)))" ".carry/bundle$i/"
done
ls -l .carry/bundle*/
