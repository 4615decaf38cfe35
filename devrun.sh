export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELPLAN_COMMIT=$1
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$2" = tests ]; then
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu -x tests/test_sparse24_wg.py tests/test_sparse24_ws.py tests/test_sparse24_layout.py tests/test_sparse24_dispatch.py 2>&1 | tail -8
timeout 200 python bench/sparse24_model.py --out $OUT/sparse24-model-h200.json 2>&1 | tail -25
fi
if [ "$2" = sweep ]; then
timeout 580 python -m kernelplan bench sparse24 --sweep --json $OUT/sparse24-sweep-h200.json 2>&1 | tail -30
fi
if [ "$2" = h100 ]; then
timeout 120 python -m pytest -q -p no:cacheprovider -m gpu -x tests/test_sparse24_wg.py -k "ping_pong or every_candidate" 2>&1 | tail -3
timeout 150 python bench/sparse24_model.py --out $OUT/sparse24-model-h100.json 2>&1 | tail -7
timeout 320 python -m kernelplan bench sparse24 --sweep --quick --json $OUT/sparse24-sweep-h100.json 2>&1 | tail -16
fi
