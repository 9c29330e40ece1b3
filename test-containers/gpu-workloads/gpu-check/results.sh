# Sourced by run.sh and shim-run.sh (bash): everything the check prints from here on also goes
# to a results file, which starts with what the figures need to be read: the commit the bundle
# was built from, the time, the kernel, the driver and every GPU. RESULTS names the file
# (default: results/<check>-<UTC time>.txt next to the script); results_end names it.
# results_begin NAME
results_begin() {
    local here dir
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    dir=$here/results
    RESULTS=${RESULTS:-$dir/$1-$(date -u +%Y%m%dT%H%M%SZ).txt}
    mkdir -p "$(dirname "$RESULTS")"
    : > "$RESULTS"
    exec > >(tee -a "$RESULTS") 2>&1
    echo "# $1 results"
    echo "# commit $(cat "$here/COMMIT" 2>/dev/null || echo unknown)"
    echo "# date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# host $(uname -srm), $(nproc) CPUs, $(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo) memory"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,mig.mode.current,persistence_mode \
            --format=csv,noheader 2>&1 | sed 's/^/# gpu /'
    else
        echo "# gpu nvidia-smi not found (the check reads the driver through NVML itself)"
    fi
}
results_end() { echo "# results in $RESULTS"; }
