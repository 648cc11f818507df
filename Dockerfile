# Every kvcentric service from one recipe; build from the repository root.
#   control-plane: gateway, conductor, kvs-meta, messenger (no torch)
#   engine:        prefill, decode, colocated (torch: CPU wheels by default; for CUDA ones, e.g.
#                  docker build --target engine --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .)
# Each service also has a target of its own that only names its subcommand, so an image runs it by default:
#   docker build --target decode -t kvcentric-decode .  &&  docker run kvcentric-decode --help
# docker-compose*.yml build these targets and give each container its `kvcentric <subcommand>` command.

FROM python:3.11-slim AS source
WORKDIR /app
COPY pyproject.toml README.md ./
COPY libs libs
COPY services services
ENTRYPOINT ["kvcentric"]

FROM source AS control-plane
RUN pip install --no-cache-dir .

FROM source AS engine
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" '.[engine]'
# A C/C++ compiler at run time: the CPU attention kernels build with it on first use (for the CPU they run on),
# and Triton builds its launchers with it on a GPU; without one an engine falls back to torch's ops.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

FROM control-plane AS gateway
CMD ["gateway"]

FROM control-plane AS conductor
CMD ["conductor"]

FROM control-plane AS kvs-meta
CMD ["kvs-meta"]

FROM control-plane AS messenger
CMD ["messenger"]

FROM engine AS prefill
CMD ["prefill"]

FROM engine AS decode
CMD ["decode"]

FROM engine AS colocated
CMD ["colocated"]
