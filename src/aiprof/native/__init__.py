"""The native sidecar: a process beside the job that records what Python cannot see — library
calls through Frida probes (probe files), sampled blocked system calls, py-spy --native stacks
(docs/capture.md, "Native data")."""
