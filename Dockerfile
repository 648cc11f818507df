# Every kvcentric service from one recipe; build from the repository root.
#   control-plane: gateway, conductor, kvs-meta, messenger (no torch)
#   engine:        prefill, decode, colocated (torch: CPU wheels by default)
# Each service also has a target of its own whose default command is its subcommand:
#   docker build --target decode -t kvcentric-decode .  &&  docker run kvcentric-decode --help
# (`docker run kvcentric-engine decode --help` says the same). docker-compose*.yml build these targets.
#
# Build arguments:
#   PYTHON_IMAGE     the base image, pinned; point it at your mirror, or add a digest (python:3.11.11-slim-bookworm@sha256:...)
#   TORCH_INDEX_URL  where pip finds torch (CUDA: https://download.pytorch.org/whl/cu128; "" for none: an air-gapped
#                    build takes torch from TORCH_WHEELS alone)
#   TORCH_WHEELS     a folder of the build context holding wheels (torch's) pip installs from first (deploy/wheels)
#   RUNTIME_PACKAGES Debian packages added to the runtime images (a CUDA engine image wants gcc: Triton builds its
#                    launchers at run time)
# The images run as the unprivileged user kvcentric (uid 10001) and carry no compiler: the CPU kernels are built
# for avx512, avx2 and portable x86-64 in the build stage and the engine loads the widest this CPU runs.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---------------------------------------------------------------- build stages (compilers and pip caches stay here)
# The dependencies go in first, in a layer of their own (from pyproject.toml alone); the source after them, so a
# change of the code reinstalls nothing but the project.
FROM ${PYTHON_IMAGE} AS build-control
WORKDIR /src
COPY pyproject.toml deploy/docker/requirements.py ./
RUN python -m venv /opt/kvcentric && python requirements.py pyproject.toml > requirements.txt && \
    /opt/kvcentric/bin/pip install --no-cache-dir -r requirements.txt
COPY README.md ./
COPY libs libs
COPY services services
RUN /opt/kvcentric/bin/pip install --no-cache-dir --no-deps .

FROM ${PYTHON_IMAGE} AS build-engine
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /src
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEELS=deploy/wheels
COPY ${TORCH_WHEELS} /wheels
COPY pyproject.toml deploy/docker/requirements.py ./
RUN python -m venv /opt/kvcentric && python requirements.py pyproject.toml engine > requirements.txt && \
    /opt/kvcentric/bin/pip install --no-cache-dir --find-links /wheels \
        ${TORCH_INDEX_URL:+--extra-index-url "${TORCH_INDEX_URL}"} -r requirements.txt
COPY README.md ./
COPY libs libs
COPY services services
# The CPU kernels for every x86-64 level, built here where the compiler is (the runtime image has none).
RUN /opt/kvcentric/bin/pip install --no-cache-dir --no-deps . && \
    KVC_KERNEL_PREBUILT=/opt/kvcentric/kernels /opt/kvcentric/bin/python -m kvcentric.engine.model.kernels --prebuild

# ---------------------------------------------------------------- runtime: the interpreter, the venv, no compiler
FROM ${PYTHON_IMAGE} AS runtime
ARG RUNTIME_PACKAGES=""
RUN if [ -n "${RUNTIME_PACKAGES}" ]; then apt-get update && \
        apt-get install -y --no-install-recommends ${RUNTIME_PACKAGES} && rm -rf /var/lib/apt/lists/*; fi && \
    groupadd --system --gid 10001 kvcentric && \
    useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/kvcentric kvcentric
COPY deploy/docker/entrypoint.sh /usr/local/bin/kvcentric-entrypoint
ENV PATH=/opt/kvcentric/bin:${PATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    KVC_KERNEL_PREBUILT=/opt/kvcentric/kernels KVC_KERNEL_CACHE=/tmp/kvcentric/kernels
WORKDIR /home/kvcentric
USER 10001:10001
ENTRYPOINT ["kvcentric-entrypoint"]

FROM runtime AS control-plane
COPY --from=build-control /opt/kvcentric /opt/kvcentric

FROM runtime AS engine
COPY --from=build-engine /opt/kvcentric /opt/kvcentric

FROM control-plane AS gateway
ENV KVC_SERVICE=gateway
CMD ["gateway"]

FROM control-plane AS conductor
ENV KVC_SERVICE=conductor
CMD ["conductor"]

FROM control-plane AS kvs-meta
ENV KVC_SERVICE=kvs-meta
CMD ["kvs-meta"]

FROM control-plane AS messenger
ENV KVC_SERVICE=messenger
CMD ["messenger"]

FROM engine AS prefill
ENV KVC_SERVICE=prefill
CMD ["prefill"]

FROM engine AS decode
ENV KVC_SERVICE=decode
CMD ["decode"]

FROM engine AS colocated
ENV KVC_SERVICE=colocated
CMD ["colocated"]
