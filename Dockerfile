# A small image of gmock_engine, the mock engine only (the vLLM frontend runs
# in its own image, see deploy/k8s/). Build from the checkout:
#
#   docker build -t gmock-engine .
#   docker run --rm gmock-engine --handshake-address tcp://FRONTEND_HOST:29550 --engine-count 4
#
# Every option also works as a GMOCK_<FLAG> variable (README, Configuration).
FROM python:3.12-slim

WORKDIR /src
# setup.cfg reads README.md (long_description) and gmock_engine.__version__.
COPY setup.cfg setup.py README.md ./
COPY gmock_engine ./gmock_engine
RUN pip install --no-cache-dir --disable-pip-version-check . \
    && rm -rf /src

WORKDIR /
# Unprivileged: the engine only connects out (and binds --metrics-port if given).
USER nobody
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["gmock-engine"]
