"""Moving messages between ranks, free of SGLang and of transfer policy: the ZMQ transport,
the control loop with its peer liveness, and the bootstrap server's HTTP client.
"""
