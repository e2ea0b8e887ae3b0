package repair

import "testing"

func TestPodUIDInCgroupPath(t *testing.T) {
	const uid = "c9f6489b-3f23-45b1-b3bb-9328fd1ebf64"
	for line, want := range map[string]string{
		"4:cpu:/kubepods/besteffort/pod" + uid + "/0d0fee649a1d":                                                                                 uid,
		"4:cpu:/istio-cni-node-1/kubepods/burstable/pod" + uid + "/0d0f":                                                                         uid,
		"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podc9f6489b_3f23_45b1_b3bb_9328fd1ebf64.slice/cri-containerd-0d0f.scope": uid,
		"0::/../../kubepods/pod" + uid + "/abc":                                                                                                  uid,
		"4:cpu:/user.slice/user-1000.slice/session-3.scope":                                                                                      "",
		"4:cpu:/tmp/notapod" + uid:                                                                                                               "",
		"4:cpu:/kubepods/besteffort/pod" + uid[:35]:                                                                                              "",
		"4:cpu:/kubepods/besteffort/pod" + uid + "x":                                                                                             "",
		"4:cpu:/kubepods/besteffort/podC9F6489B-3F23-45B1-B3BB-9328FD1EBF64":                                                                     "",
	} {
		if got := PodUIDInCgroupPath(line); got != want {
			t.Errorf("PodUIDInCgroupPath(%q) = %q, want %q", line, got, want)
		}
	}
}
