# A Prometheus image built from Debian's prometheus package, for machines that reach no image
# registry (ops/build-local.sh tags it local/prometheus:bookworm). Elsewhere compose.yaml runs
# the public prom/prometheus image, whose entrypoint, paths and user this one copies.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
    && apt-get clean && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus \
    && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
