# Sourced by the GPU check scripts: the Python to run ($P), the device and versions printed once, and `step NAME`
# (a timestamped section header).
P=$(command -v python || command -v python3)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
"$P" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step() { echo "== $1 ($(date -u +%H:%M:%S))"; }
