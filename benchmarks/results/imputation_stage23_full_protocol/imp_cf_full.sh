#!/bin/bash
# the imputation protocol with the shipped stage-23 weights (tabfm-tiny-cf) and mixed column regressors, one dataset at a time (fast first), into the shared cache
cd /work/main
for d in penguins wine cps1985 concrete boston college credit_data breast_cancer; do
  nice -n 5 tabfm eval --task imputation --suite public --methods tabfm --cache runs/eval-cache --threads 1 --out runs/eval/imp-cf-$d --datasets $d --quiet > runs/eval/imp-cf-$d.log 2>&1
  echo "$d done $(date -u)" >> runs/imp_cf_full.done
done
