"""One unary gRPC call over a bare HTTP/2 connection, with headers a client library will not
send as given (a `grpc-timeout` the client itself does not enforce)."""
import socket
import struct
import urllib.parse

import h2.config
import h2.connection
import h2.events
import h2.settings


def call(port, method, message, headers=(), timeout=30):
    """Sends `message` (serialized protobuf) to `method` ("/pkg.Service/Method"); returns
    (grpc-status, grpc-message, response bytes)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    stream = conn.get_next_available_stream_id()
    conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", method),
                               (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
                               ("te", "trailers"), *headers])
    conn.send_data(stream, b"\x00" + struct.pack(">I", len(message)) + message, end_stream=True)
    sock.sendall(conn.data_to_send())
    data, trailers = b"", {}
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            for event in conn.receive_data(chunk):
                if isinstance(event, h2.events.DataReceived):
                    data += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, stream)
                elif isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    trailers.update({k.decode(): v.decode() for k, v in event.headers})
                elif isinstance(event, h2.events.StreamEnded):
                    return int(trailers.get("grpc-status", "-1")), urllib.parse.unquote(trailers.get("grpc-message", "")), data[5:]
            sock.sendall(conn.data_to_send())
    finally:
        sock.close()
    raise ConnectionError("the server closed the connection before the call ended")


def unread_stream(port, messages, window=1, end=False):
    """Opens a `ModelStreamInfer` stream, sends `messages` (serialized requests, up to 64 KiB in
    all: the server's first window) on it (`end`: then ends its side of the stream) and never
    reads a reply: a window of `window` bytes keeps the server from sending more. Returns the
    socket; the stream lives until it closes."""
    sock = socket.create_connection(("127.0.0.1", port))
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
    conn.local_settings = h2.settings.Settings(client=True, initial_values={
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window, h2.settings.SettingCodes.ENABLE_PUSH: 0})
    conn.initiate_connection()
    stream = conn.get_next_available_stream_id()
    conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"),
                               (":path", "/inference.GRPCInferenceService/ModelStreamInfer"),
                               (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
                               ("te", "trailers")])
    framed = b"".join(b"\x00" + struct.pack(">I", len(m)) + m for m in messages)
    for at in range(0, len(framed), 16384):
        conn.send_data(stream, framed[at:at + 16384], end_stream=end and at + 16384 >= len(framed))
    sock.sendall(conn.data_to_send())
    return sock
