# Arize Phoenix, a real OTLP trace receiver, on a locally built base: it stands in for
# Jaeger where Docker Hub's images cannot be pulled (deploy/compose.local.yaml). It takes
# Jaeger's OTLP ports: HTTP (with its UI and REST API) on 4318, gRPC on 4317.
ARG BASE_IMAGE=local/debian:bookworm
FROM ${BASE_IMAGE}
ARG EXTRA_CA_CERTS
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && if [ -n "$EXTRA_CA_CERTS" ]; then \
        printf '%s\n' "$EXTRA_CA_CERTS" > /usr/local/share/ca-certificates/extra.crt \
        && update-ca-certificates >/dev/null 2>&1; fi \
    && python3 -m venv /opt/phoenix \
    && PIP_CERT=/etc/ssl/certs/ca-certificates.crt /opt/phoenix/bin/pip install \
        --no-cache-dir -q "arize-phoenix>=20.26,<21" \
    && useradd --create-home --uid 10001 phoenix
ENV PHOENIX_HOST=127.0.0.1 PHOENIX_PORT=4318 PHOENIX_GRPC_PORT=4317 \
    PHOENIX_WORKING_DIR=/home/phoenix/work PHOENIX_TELEMETRY_ENABLED=false \
    PHOENIX_ALLOW_EXTERNAL_RESOURCES=false
USER phoenix
CMD ["/opt/phoenix/bin/phoenix", "serve"]
