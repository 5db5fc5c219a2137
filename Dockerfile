# The cosyvoice-serve image: the repository installed with `.[text,gpu,s3]` on a CUDA runtime base, run as the non-root
# user `ray` (uid 1000), models read from the volume mounted at /models: the Hugging Face cache is there (HF_HOME), so a
# model named by its id is downloaded once into the volume (`cosyvoice-serve download <id>`) and the replicas find it
# there. Build it from the repository root:
#   docker build -t cosyvoice-serve:0.1.0 .
# kuberay/rayservice.yaml and ray_cluster.yaml (its `docker` section) name this tag (a test checks the three agree):
# push it to a registry the nodes pull from and put the registry's name in front of the tag in both.
# The torch that `pip` picks is PyPI's Linux wheel, which brings its own CUDA libraries; the node's NVIDIA driver
# must be new enough for that CUDA (torch 2.14 wheels: CUDA 13, driver >= 580). This image has not been built here:
# the machine that wrote it has no docker.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/models/huggingface

# python3 (3.12 on Ubuntu 24.04), venv, and wget + bash for KubeRay's probes; soundfile, PyAV and onnxruntime wheels
# bring their own native libraries.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates wget bash \
    && rm -rf /var/lib/apt/lists/*

# The non-root user Ray runs as (Ubuntu's base image has `ubuntu` at uid 1000: it makes room), the model volume, and
# the venv on PATH for login shells too (KubeRay starts Ray with `bash -lc`, and /etc/profile resets PATH).
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --create-home --uid 1000 --shell /bin/bash ray \
    && mkdir -p /models /opt/venv \
    && chown ray:ray /models /opt/venv \
    && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/cosyvoice-venv.sh
USER ray
WORKDIR /home/ray/cosyvoice-serve

RUN python3 -m venv /opt/venv && pip install --upgrade pip

# The project and its `text` (wetext) and `gpu` (nvidia-ml-py: the decoders' NVML readings) extras.
COPY --chown=ray:ray pyproject.toml README.md ./
COPY --chown=ray:ray engine ./engine
COPY --chown=ray:ray deployments ./deployments
COPY --chown=ray:ray serve_app ./serve_app
COPY --chown=ray:ray autoscaling ./autoscaling
# not installed: the benchmark scripts run from this directory (`python -m benchmarks.compare`, gpu_check.sh)
COPY --chown=ray:ray benchmarks ./benchmarks
COPY --chown=ray:ray observability ./observability
COPY --chown=ray:ray configs ./configs
RUN pip install ".[text,gpu,s3]" && python -c "import engine, serve_app, autoscaling, ray, torch"

VOLUME /models
EXPOSE 8000
CMD ["cosyvoice-serve", "--help"]
