"""Timeline exports of a capture: Perfetto protobuf (``perfetto``) and Chrome JSON (``chrome``)."""
