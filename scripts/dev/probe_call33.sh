# The 33rd session's second call: the 32-token scan at BV = 64 (fwd_scan_bv_alone) against 128 in one
# process; the bench's bounded_b1 forward three times (plain, plain, --host-ahead).
A="python3 scripts/fwd_chunk_ab.py --rounds 2 --iters 10"
echo "=== HEAD (c32 scan at BV 64)"; $A bounded_b16 prod8192 gva small varlen
echo "=== KERNEL_FUN_KDA_SCAN_BV=128"; KERNEL_FUN_KDA_SCAN_BV=128 $A bounded_b16 prod8192 gva small varlen
for r in 1 2; do
  echo "=== bench bounded_b1 run $r"
  python3 -m kernel_fun.bench --family kda --case bounded_b1 --no-fla --out /tmp/b1_$r 2>&1 | grep -E "^\[bounded_b1"
done
echo "=== bench bounded_b1 --host-ahead"
python3 -m kernel_fun.bench --family kda --case bounded_b1 --no-fla --host-ahead --out /tmp/b1_ha 2>&1 | grep -E "^\[bounded_b1"
