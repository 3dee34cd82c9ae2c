#!/bin/bash
# stage 22's evaluation: classification model alone || (regression; imputation subset) || refs18's imputation subset with numeric="mixed" classifiers
cd /work/main
M=runs/refs22/export
( /usr/bin/time -f "cls %e s" tabfm eval --task classification --suite public --methods tabfm --model $M --tabfm-params multiclass=native,numeric=raw --cache runs/eval-cache --out runs/eval/refs22-cls --threads 1 --quiet > runs/eval/refs22-cls.log 2>&1 ) &
( /usr/bin/time -f "reg %e s" tabfm eval --task regression --suite runs/regression-suite --methods tabfm --model $M --cache runs/eval-cache --out runs/eval/refs22-reg --threads 1 --quiet > runs/eval/refs22-reg.log 2>&1
  /usr/bin/time -f "imp %e s" python benchmarks/imputation_rounds.py --settings columns:1 --model $M --out runs/eval/refs22-imp.json > runs/eval/refs22-imp.log 2>&1 ) &
( /usr/bin/time -f "imp18 %e s" python benchmarks/imputation_rounds.py --settings columns:1 --model tabfm-tiny-cf --out runs/eval/refs18-imp-mixed.json > runs/eval/refs18-imp-mixed.log 2>&1 ) &
wait
echo done
