#!/bin/bash
# deep6's evaluation on two cores: classification model alone then regression defaults on one, the imputation subset on the other
cd /work/main
S=${1:-deep6}
M=runs/$S/export
( /usr/bin/time -f "cls %e s" tabfm eval --task classification --suite public --methods tabfm --model $M --tabfm-params multiclass=native,numeric=raw,local_context=0 --cache runs/eval-cache --out runs/eval/$S-cls --threads 1 --quiet > runs/eval/$S-cls.log 2>&1
  /usr/bin/time -f "reg %e s" tabfm eval --task regression --suite runs/regression-suite --methods tabfm --model $M --cache runs/eval-cache --out runs/eval/$S-reg --threads 1 --quiet > runs/eval/$S-reg.log 2>&1 ) &
/usr/bin/time -f "imp %e s" python benchmarks/imputation_rounds.py --settings columns:1 --model $M --out runs/eval/$S-imp.json > runs/eval/$S-imp.log 2>&1
wait
echo done
