set -x
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELPLAN_COMMIT=$1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu -x tests/test_sparse24_wg.py tests/test_sparse24_ws.py 2>&1 | tail -15
timeout 360 python bench/sparse24_wg_tiles.py --kernel ws --rounds 3 --out $OUT/sparse24-ws-tiles-h200.json 2>&1 | tail -100
