# polyspec, CPU image by default. Installs the package the README's way.
#   docker build -t polyspec .
# A CUDA build: docker build --build-arg BASE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime --build-arg TORCH_SPEC=torch -t polyspec:cuda .
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
WORKDIR /opt/polyspec
COPY . .
RUN python -m pip install --no-cache-dir ${TORCH_SPEC} && python -m pip install --no-cache-dir -e .
EXPOSE 50051 9464
ENTRYPOINT ["polyspec"]
CMD ["serve", "-c", "configs/demo.yaml", "--host", "0.0.0.0", "--port", "50051", "--state-dir", "/var/lib/polyspec"]
