# A Redis image built from Debian's redis-server, for machines that reach no image registry
# (ops/build-local.sh tags it local/redis:bookworm). Elsewhere compose.yaml runs the public
# redis image. Like that image: data in /data, not root, reachable from other containers.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && apt-get clean && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data \
    && chown redis:redis /data
USER redis
WORKDIR /data
EXPOSE 6379
# No config file: listen on every interface; protected mode off as in the public image (the
# compose network is the only way in; `pagedserve serve`'s own Redis uses a password).
CMD ["redis-server", "--protected-mode", "no", "--dir", "/data"]
