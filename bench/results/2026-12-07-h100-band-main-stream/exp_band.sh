set -u
root=$(pwd); b=/tmp/b; m=/tmp/bm
mkdir -p $b && xz -dc .gpubundle/gb.tar.xz | tar -C $b -xf -
cp -r $b $m && cp $b/oldlib/libkernels_Scuda_Slibkernels.so $m/
export TE_CLIENT_STUBS_DIR="$root/.gpubundle/proto"
py=python3; $py -c "import grpc, google.protobuf, numpy" 2>/dev/null || py=/opt/torch/.venv/bin/python
nvidia-smi --query-gpu=name --format=csv,noheader
( cd $b && ./run.sh relative_band_gpu_test 2>&1 | tail -3 )
( cd $m && ./run.sh relative_band_gpu_test 2>&1 | tail -3 )
for rep in 1 2; do
for lib in $b $m; do
  echo "=== lib $lib rep $rep"
  $py bench/lm_bench.py --server="$lib/run.sh te_server" --peer= --sizes=24x1024x16x1024x8 --bias=on,off --recipes=delayed --steps=20 --warmup=5 2>&1 | grep -E "^ours|Error|error" 
done; done
