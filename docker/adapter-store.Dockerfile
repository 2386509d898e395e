# The adapter store: slim, CPU only, no model code.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protos ./protos
COPY lora ./lora
COPY lora_common ./lora_common
COPY adapter_store ./adapter_store
COPY inference_node ./inference_node
COPY kernels ./kernels
COPY lora_client ./lora_client
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 store
COPY --from=build /wheels /wheels
# The store needs only the light dependencies (no torch).
RUN pip install --no-cache-dir /wheels/*.whl --no-deps \
 && pip install --no-cache-dir "grpcio>=1.66" "grpcio-health-checking>=1.66" "grpcio-reflection>=1.66" \
      "protobuf>=5.27" "safetensors>=0.4" "blake3>=1.0" "numpy>=1.26" "boto3>=1.34" "prometheus-client>=0.20" "tqdm>=4.66" \
 && rm -rf /wheels
COPY samples/adapters /opt/lora-serving/samples
USER store
ENV ADAPTER_STORE_HOST=0.0.0.0 \
    ADAPTER_STORE_PORT=50061 \
    ADAPTER_STORE_CACHE_DIR=/home/store/cache
EXPOSE 50061
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD ["python", "-m", "lora_client.healthcheck", "127.0.0.1:50061"]
ENTRYPOINT ["adapter-store"]
CMD ["serve"]
