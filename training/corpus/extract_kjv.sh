#!/bin/sh
# Regenerate kjv.txt from the Debian `bible-kjv` package (King James Version, public domain).
# One verse per line, references stripped. Run from this directory: ./extract_kjv.sh > kjv.txt
set -eu
for range in \
    Gen1:1-Gen50:26 Exo1:1-Exo40:38 Ruth1:1-Ruth4:22 1Sa1:1-1Sa31:13 2Sa1:1-2Sa24:25 \
    Ps1:1-Ps150:6 Pro1:1-Pro31:31 Mat1:1-Mat28:20 Mark1:1-Mark16:20 Luke1:1-Luke24:53 John1:1-John21:25
do
    bible -f "$range"
done | sed -E 's/^[0-9]?[A-Za-z]+[0-9]+:[0-9]+ //'
