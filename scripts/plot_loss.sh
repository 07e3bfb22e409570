#!/usr/bin/env bash
# Plots a training CSV log (ptllm train writes X.log.csv) to a PNG with gnuplot.
#   scripts/plot_loss.sh models/shakespeare.log.csv models/shakespeare-loss.png
set -euo pipefail
csv=$1
png=${2:-${csv%.log.csv}-loss.png}
command -v gnuplot >/dev/null || { echo "needs gnuplot (apt-get install gnuplot-nox)" >&2; exit 1; }
gnuplot <<GP
set datafile separator ","
set datafile missing ""
set terminal pngcairo size 900,540 font "sans,11" noenhanced
set output "$png"
set title "$(basename "$csv"): loss (nats/char)"
set xlabel "step"
set ylabel "loss"
set grid
set key top right
plot "$csv" every ::1 using 1:2 with lines lw 1 lc rgb "#7799cc" title "train", \
     "" every ::1 using 1:3 with linespoints lw 2 pt 7 lc rgb "#cc3333" title "validation"
GP
echo "wrote $png" >&2
