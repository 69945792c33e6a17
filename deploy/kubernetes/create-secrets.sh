#!/bin/sh
# Makes the two Secrets the manifests read, in namespace pagedserve, with random passwords:
#   pagedserve-redis      redis-password (the primary and replica), sentinel-password (the Sentinels)
#   pagedserve-api-keys   api-keys: "KEY:TENANT,..." (the gateway's PAGEDSERVE_API_KEYS)
# Run it once before `kubectl apply -k deploy/kubernetes/overlays/...`. API keys: give them in
# PAGEDSERVE_API_KEYS; without it one key is drawn for tenant `default` and printed once.
# The values go through 0600 files, never kubectl's argv. Existing Secrets are left alone.
set -eu
namespace=${NAMESPACE:-pagedserve}
kubectl get namespace "$namespace" >/dev/null 2>&1 || kubectl create namespace "$namespace"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
umask 077
random() { head -c 24 /dev/urandom | base64 | tr -d '/+=\n'; }

if ! kubectl -n "$namespace" get secret pagedserve-redis >/dev/null 2>&1; then
    printf 'redis-password=%s\nsentinel-password=%s\n' "$(random)" "$(random)" > "$dir/redis.env"
    kubectl -n "$namespace" create secret generic pagedserve-redis --from-env-file="$dir/redis.env"
fi
if ! kubectl -n "$namespace" get secret pagedserve-api-keys >/dev/null 2>&1; then
    keys=${PAGEDSERVE_API_KEYS:-}
    if [ -z "$keys" ]; then
        keys="sk-$(random):default"
        echo "API key for tenant default (shown once): ${keys%:default}" >&2
    fi
    printf 'api-keys=%s\n' "$keys" > "$dir/api-keys.env"
    kubectl -n "$namespace" create secret generic pagedserve-api-keys --from-env-file="$dir/api-keys.env"
fi
