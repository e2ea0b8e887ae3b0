module github.com/istio-cni-go/istio-cni

go 1.25

require (
	github.com/containernetworking/plugins v1.9.1
	github.com/google/nftables v0.3.0
	github.com/vishvananda/netlink v1.3.1
	golang.org/x/sys v0.35.0
)

require (
	github.com/containernetworking/cni v1.3.0 // indirect
	github.com/google/go-cmp v0.7.0 // indirect
	github.com/mdlayher/netlink v1.7.3-0.20250113171957-fbb4dce95f42 // indirect
	github.com/mdlayher/socket v0.5.1 // indirect
	github.com/vishvananda/netns v0.0.5 // indirect
	golang.org/x/net v0.43.0 // indirect
	golang.org/x/sync v0.16.0 // indirect
)
