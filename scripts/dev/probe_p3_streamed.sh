# The streamed forwards (long_b1_t32k, bounded_b1) and varlen with the balanced P3
# (intra-p3-balance.patch, ab_alt) against this tree, the trees alternating, three times: call 2 of
# the 34th session read long_b1_t32k's streamed forward 2.3% slower in the patched tree (one round).
A="python3 scripts/fwd_chunk_ab.py --rounds 2 --iters 10 long_b1_t32k bounded_b1 varlen"
q() { grep -v "UserWarning\|_warn_once"; }
bash scripts/use_prebuilt.sh ab_alt | tail -1
for r in 1 2 3; do
  echo "=== HEAD ($r)"; $A 2>&1 | q | tail -4
  echo "=== balanced ($r)"; PYTHONPATH=$PWD/ab_alt/src:$PYTHONPATH $A 2>&1 | q | tail -4
done
