# relay's container image (Docker and Podman). docs/deploying.md.
#
#   docker build -t relay .                       # on python:3.11-slim-bookworm
#   podman build --format docker -t relay .       # the same with Podman (docker format keeps
#                                                 #   the HEALTHCHECK; OCI images drop it)
#   podman build --format docker --build-arg BASE=localhost/relay-base:bookworm -t relay .
#                                                 # on a base made without a registry:
#                                                 #   scripts/container-base.sh
#
# The base is any Debian-like image with python3 (3.11+) and its venv module:
# python:3.11-slim-bookworm, or Debian bookworm's python3 + python3-venv +
# ca-certificates. relay goes into /opt/relay (a virtual environment) from this
# checkout, and runs as the unprivileged user relay (uid 10001):
#
#   twistd -n --pidfile= relay --config /etc/relay/relay.yaml
#
# Mount the configuration at /etc/relay/relay.yaml (read-only) and a volume at
# /var/lib/relay (the SQLite `database:` lives there: point it at
# /var/lib/relay/relay.sqlite). SIGTERM drains: running turns finish within
# gateway.shutdown_grace_seconds (default 30; +10 with workers), so give the
# container a stop timeout above that (docker run --stop-timeout 45, compose
# stop_grace_period: 45s).
ARG BASE=docker.io/library/python:3.11-slim-bookworm
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/relay/bin:$PATH

# The dependencies first (their layer is reused while setup.cfg is unchanged),
# then relay itself.
COPY setup.cfg pyproject.toml README.md /src/
RUN python3 -m venv /opt/relay \
 && mkdir -p /src/relay \
 && /opt/relay/bin/pip install --no-compile /src \
 && /opt/relay/bin/pip uninstall -y relay
COPY relay /src/relay
COPY twisted /src/twisted
# twistd's plugin cache is written now: the relay user cannot write there.
RUN /opt/relay/bin/pip install --no-compile --no-deps /src \
 && rm -rf /src \
 && /opt/relay/bin/python -c "from twisted.plugin import IPlugin, getPlugins; list(getPlugins(IPlugin))" \
 && /opt/relay/bin/python -m compileall -q /opt/relay/lib \
 && useradd --system --uid 10001 --user-group --home-dir /var/lib/relay \
      --shell /usr/sbin/nologin relay \
 && mkdir -p /etc/relay /var/lib/relay \
 && chown relay:relay /var/lib/relay

COPY etc/container.yaml /etc/relay/relay.yaml

USER relay
WORKDIR /var/lib/relay
VOLUME ["/var/lib/relay"]
EXPOSE 8080
STOPSIGNAL SIGTERM

# Liveness: /healthz answers while the process serves HTTP. (Readiness,
# /readyz, is for load balancers and compose's depends_on: it says 503 while
# Redis does not answer or the stores load, and an orchestrator that restarts
# "unhealthy" containers must not restart relay for that.) RELAY_HEALTH_URL
# overrides the address for a config that listens elsewhere.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python3", "-c", "import os, sys, urllib.request; u = os.environ.get('RELAY_HEALTH_URL', 'http://127.0.0.1:8080/healthz'); sys.exit(0 if urllib.request.urlopen(u, timeout=2).status == 200 else 1)"]

ENTRYPOINT ["twistd", "-n", "--pidfile=", "relay"]
CMD ["--config", "/etc/relay/relay.yaml"]
