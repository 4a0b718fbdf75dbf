#!/bin/bash
# ANOMALY_MODE's pair on this machine (bench/diagnosis/cpu_anomaly.py): see cpu_pair.sh.
exec bash "$(dirname "$0")/cpu_pair.sh" bench/diagnosis/cpu_anomaly.py --anomaly ANOMALY_MODE
