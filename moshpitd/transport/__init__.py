"""gRPC transport between daemons (grpc.aio): the Averager service and hand-framed parts."""
