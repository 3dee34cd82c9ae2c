#!/bin/bash
# stage 24's evaluation on one core, beside the imputation protocol: classification model alone, then
# regression (defaults: mixed members), then the imputation subset (defaults: mixed column regressors)
cd /work/main
M=runs/refs24/export
/usr/bin/time -f "cls %e s" tabfm eval --task classification --suite public --methods tabfm --model $M --tabfm-params multiclass=native,numeric=raw --cache runs/eval-cache --out runs/eval/refs24-cls --threads 1 --quiet > runs/eval/refs24-cls.log 2>&1
/usr/bin/time -f "reg %e s" tabfm eval --task regression --suite runs/regression-suite --methods tabfm --model $M --cache runs/eval-cache --out runs/eval/refs24-reg --threads 1 --quiet > runs/eval/refs24-reg.log 2>&1
/usr/bin/time -f "imp %e s" python benchmarks/imputation_rounds.py --settings columns:1 --model $M --out runs/eval/refs24-imp.json > runs/eval/refs24-imp.log 2>&1
echo done
