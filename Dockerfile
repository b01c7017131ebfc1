# twinkle-server on a CUDA base image. Not built in CI (no Docker engine there); it runs the
# same scripts/setup.sh as a developer machine, with the CUDA engine enabled.
#   docker build -t twinkle-server .
#   docker run --gpus all -p 127.0.0.1:50051:50051 -p 127.0.0.1:8000:8000 \
#     -v /models:/models twinkle-server launch -c /etc/twinkle/config.yaml
# The CUDA major version of the image must equal the torch wheel's (13 for torch 2.11.0);
# cmake/TorchCuda.cmake checks it.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-cudnn-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive TWINKLE_CACHE=/opt/twinkle TWINKLE_WITH_CUDA=1 CCACHE_DIR=/tmp/ccache
RUN apt-get update -q && apt-get install -y -q --no-install-recommends python3 python3-venv git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The venv lands in /opt/twinkle/venv-<hash>; the engine's RPATH points there, so the
# runtime stage copies /opt/twinkle whole, at the same path.
RUN ./scripts/setup.sh

FROM ${CUDA_RUNTIME_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# Runtime libraries of the coordinator and engine (the -dev packages' shared objects).
RUN apt-get update -q && apt-get install -y -q --no-install-recommends \
      libgrpc++1.51t64 libprotobuf32t64 libyaml-cpp0.8 libzmq5 libssl3t64 libabsl20220623t64 \
      libprometheus-cpp-core1.0 python3 \
    && rm -rf /var/lib/apt/lists/* || \
    (echo "adjust the runtime package names to the base image's release" && exit 1)
COPY --from=build /opt/twinkle /opt/twinkle
COPY --from=build /src/build/bin /opt/twinkle/bin
COPY configs /etc/twinkle
RUN useradd --system --home /var/lib/twinkle twinkle
USER twinkle
ENTRYPOINT ["/opt/twinkle/bin/twinkle-server"]
CMD ["launch", "-c", "/etc/twinkle/default.yaml"]
