# Debian's Prometheus on a locally built base: it stands in for prom/prometheus where
# Docker Hub's images cannot be pulled (deploy/compose.local.yaml). Same configuration
# path as the official image; it listens on loopback (the test stack's host network).
ARG BASE_IMAGE=local/debian:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/*
USER prometheus
CMD ["prometheus", "--config.file=/etc/prometheus/prometheus.yml", \
     "--storage.tsdb.path=/tmp/prometheus", "--web.listen-address=127.0.0.1:9090"]
