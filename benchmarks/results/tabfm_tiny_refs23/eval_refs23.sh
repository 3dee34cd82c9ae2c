#!/bin/bash
# a stage's evaluation (argument: its run directory under runs/, default refs23) on one core, beside the imputation protocol: classification model alone, then
# regression (defaults: mixed members), then the imputation subset (defaults: mixed column regressors)
cd /work/main
S=${1:-refs23}
M=runs/$S/export
/usr/bin/time -f "cls %e s" tabfm eval --task classification --suite public --methods tabfm --model $M --tabfm-params multiclass=native,numeric=raw,local_context=0 --cache runs/eval-cache --out runs/eval/$S-cls --threads 1 --quiet > runs/eval/$S-cls.log 2>&1
/usr/bin/time -f "reg %e s" tabfm eval --task regression --suite runs/regression-suite --methods tabfm --model $M --cache runs/eval-cache --out runs/eval/$S-reg --threads 1 --quiet > runs/eval/$S-reg.log 2>&1
/usr/bin/time -f "imp %e s" python benchmarks/imputation_rounds.py --settings columns:1 --model $M --out runs/eval/$S-imp.json > runs/eval/$S-imp.log 2>&1
echo done
