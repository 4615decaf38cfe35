export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELPLAN_COMMIT=$1
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$2" = probe ]; then timeout 200 python devprobe.py 2>&1 | tail -45; fi
if [ "$2" = cold ]; then
timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/test_sweep.py 2>&1 | tail -2
timeout 530 python -m kernelplan bench sparse24 --sweep $3 --json $OUT/sparse24-sweep-$4.json 2>&1 | tail -18
fi
