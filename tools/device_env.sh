# Sourced by the GPU scripts (tools/gpu_run.sh, tools/gpu_generate.sh): the wheels the device
# image lacks, where the call carried them (tools/device_wheels.sh fills .whl/).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
