# packd's server image: packd and packctl with only their runtime libraries, run as a non-root
# user. Build and run (deploy/README.md says more, and how to build the GPU images):
#
#   docker build -t packd:latest .
#   docker run --rm -p 50051:50051 -p 9090:9090 packd:latest          # extra arguments go to packd
#   docker run --rm --network host packd:latest --listen=127.0.0.1:50051 --device=cpu
#
# Build arguments:
#   BASE_IMAGE        the build stage's base (default debian:bookworm-slim); where no registry
#                     serves it, deploy/make-base-image.sh makes a Debian 12 one
#   RUNTIME_IMAGE     the runtime stage's base (default: BASE_IMAGE); the same distribution as
#                     BASE_IMAGE, since the libraries come from the build stage
#   PACKD_WITH_CUDA   ON: the CUDA backend (a BASE_IMAGE with nvcc, such as nvidia/cuda:*-devel)
#   PACKD_WITH_HIP    ON: the ROCm backend, with Debian's hipcc
#   PACKD_WITH_TORCH  ON: the libtorch backend too (a much larger image)
#   CMAKE_ARGS        more CMake arguments (-DCMAKE_CUDA_ARCHITECTURES=90, -DPACKD_HIP_ARCHS=gfx942)
ARG BASE_IMAGE=debian:bookworm-slim
ARG RUNTIME_IMAGE=${BASE_IMAGE}

# The build tools and libraries: a layer of its own, rebuilt only when the package list changes.
FROM ${BASE_IMAGE} AS deps
ARG PACKD_WITH_HIP=OFF
ARG PACKD_WITH_TORCH=OFF
COPY deploy/install-deps.sh /src/deploy/install-deps.sh
RUN PACKD_DEPS=build \
    PACKD_WITH_HIP=$([ "$PACKD_WITH_HIP" = ON ] && echo 1 || echo 0) \
    PACKD_WITH_TORCH=$([ "$PACKD_WITH_TORCH" = ON ] && echo 1 || echo 0) \
    /src/deploy/install-deps.sh \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb

# packd and packctl, then the shared libraries they load (but the C and C++ runtimes, which the
# runtime base has), gathered under /out for the runtime stage.
FROM deps AS build
ARG PACKD_WITH_CUDA=OFF
ARG PACKD_WITH_HIP=OFF
ARG PACKD_WITH_TORCH=OFF
ARG CMAKE_ARGS=
COPY . /src
RUN cmake -S /src -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DPACKD_WITH_CUDA=$PACKD_WITH_CUDA -DPACKD_WITH_HIP=$PACKD_WITH_HIP \
      -DPACKD_WITH_TORCH=$PACKD_WITH_TORCH -DPACKD_BUILD_TESTS=OFF -DPACKD_BUILD_BENCHMARKS=OFF \
      $CMAKE_ARGS \
 && cmake --build /build --target packd packctl \
 && mkdir -p /out/usr/local/bin /out/usr/local/lib/packd /out/etc/ld.so.conf.d \
 && cp /build/bin/packd /build/bin/packctl /out/usr/local/bin/ \
 && ldd /build/bin/packd /build/bin/packctl | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u \
    | grep -Ev '/(libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+)\.so' \
    | xargs -r cp -L -t /out/usr/local/lib/packd/ \
 && echo /usr/local/lib/packd > /out/etc/ld.so.conf.d/packd.conf

FROM ${RUNTIME_IMAGE}
COPY --from=build /out/ /
RUN ldconfig \
 && echo 'packd:x:65532:65532:packd:/nonexistent:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'packd:x:65532:' >> /etc/group \
 && if ldd /usr/local/bin/packd /usr/local/bin/packctl | grep 'not found'; then exit 1; fi
USER 65532:65532
# gRPC (PackService and grpc.health.v1) and Prometheus metrics at /metrics.
EXPOSE 50051 9090
# A container listens on every interface. Arguments given to `docker run` (or a Kubernetes args:
# list) follow these, and a flag given again overrides the one here.
ENTRYPOINT ["packd", "--listen=0.0.0.0:50051", "--metrics_listen=0.0.0.0:9090"]
